"""`sdrt serve` / `sdrt-server`: sd-server's HTTP APIs over a model that stays loaded.

Needs the `server` extra (Starlette, uvicorn, python-multipart); `import sdrt` never imports it.
See docs/server.md."""
