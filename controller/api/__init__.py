"""The HTTP API (aiohttp): REST, OpenAPI and, later, the router, events, metrics, dashboard.

``app`` holds the route registry, auth and error handling; ``routes`` the REST handlers;
``server`` runs it next to the controller.
"""
