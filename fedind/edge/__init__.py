"""Tools at the line: diagnose with a model, serve it over HTTP, export it for the line's
computer, and publish new global models to the service."""
