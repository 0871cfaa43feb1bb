"""``sparda serve``: the OpenAI-compatible HTTP server (docs/serving.md).

* :mod:`sparda.server.app` - the FastAPI application, socket binding and the
  signal-handling uvicorn runner;
* :mod:`sparda.server.protocol` - the request schemas and response objects of the OpenAI API.
"""

from sparda.server.app import bind_socket, create_app, serve

__all__ = ["bind_socket", "create_app", "serve"]
