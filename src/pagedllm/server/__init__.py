"""The OpenAI-compatible HTTP server: app, routes, errors, metrics, dashboard."""
