"""An OpenAI-compatible HTTP server for exported LLMs (``coreai-torch serve``): the model
loaded as a :class:`~coreai_torch.llm.Generator` (``models``), a request queue in front of the
generations (``queue``), prompts, text and stop strings (``engine``), the request and response
bodies (``protocol``) and the Starlette application run by uvicorn (``app``).

Needs the ``serve`` extra: ``pip install 'coreai-torch-converter[serve]'``.
"""
