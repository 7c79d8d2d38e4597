"""The HTTP API's handlers, one module per API family; server/routes.py maps each path to one of them."""
