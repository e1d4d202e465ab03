"""Routing: the one routed-call script (``call``) and the decisions it takes (which slots
serve a model, leasing, aliases, keys, refusals, the header and Host rules, the endpoint
table); the data plane (``controller.dataplane``) drives it."""
