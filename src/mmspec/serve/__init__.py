"""``mmspec serve``: an OpenAI-compatible HTTP server over a :class:`~mmspec.SpecDecoder`.

Modules: :mod:`.protocol` (OpenAI's request and response objects as pydantic models),
:mod:`.schema` (the request body, checked), :mod:`.messages` (chat messages and their
images -> the prompt), :mod:`.service` (the served decoder; a request -> the scheduler's form),
:mod:`.worker` (the one thread that drives :class:`mmspec.batch.BatchScheduler`: continuous
batching), :mod:`.responses` (OpenAI's response and chunk shapes, stop strings, mmspec's stats),
:mod:`.structured` (``response_format``, ``structured_outputs``, ``tools`` -> the answer's
constraint and tool mode), :mod:`.toolcalls` (tool calls whole and streamed, the Hermes parser)
and :mod:`.app` (the FastAPI routes). Needs the ``[serve]`` extra (fastapi, uvicorn); the CLI
command is :mod:`mmspec.cli.serve`. Nothing here imports typer or :mod:`mmspec.cli`.
"""
