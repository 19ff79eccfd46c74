"""`overnight serve`: the OpenAI-compatible HTTP server. The only package that imports fastapi/uvicorn."""
