"""The router's data plane: the API's listening socket, served by callbacks."""
