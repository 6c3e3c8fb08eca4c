"""The HTTP load client: ``pagedllm bench serve`` and ``bench soak`` against any OpenAI-compatible server.

Talks to servers over HTTP only (its own, vLLM's, llama.cpp's): it never imports the engine or
the server, so it measures any of them the same way.
"""
