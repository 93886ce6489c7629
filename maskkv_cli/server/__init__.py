"""``maskkv serve``: an OpenAI-compatible HTTP server for documents, and a page to ask them (``docs/server.md``).

A presentation layer beside ``cli/``: it calls the pipeline, the session and the document store, and nothing below
imports it. It needs the ``serve`` extra (Starlette, uvicorn, python-multipart).

```python
from maskkv_cli.server import BackgroundServer, ServerConfig, create_app
from maskkv_cli.app.session import Session

app = create_app(Session("/models/LLaDA-8B-Instruct", device="cuda"), ServerConfig(queue=4))
with BackgroundServer(app) as url:      # a free port on 127.0.0.1
    ...                                  # e.g. OpenAI(base_url=url + "/v1", api_key="none")
```
"""

from maskkv_cli.server.app import create_app
from maskkv_cli.server.config import ServerConfig
from maskkv_cli.server.run import BackgroundServer, serve

__all__ = ["BackgroundServer", "ServerConfig", "create_app", "serve"]
