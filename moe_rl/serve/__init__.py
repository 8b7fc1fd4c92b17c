"""``moe-rl serve``: SGLang's native HTTP protocol around any RolloutEngine + WeightSink.

- :mod:`.protocol`: request checks, SGLang ``sampling_params`` -> our SamplingParams, the
  response bodies SGLang uses for errors and weight updates (no HTTP, no engine).
- :mod:`.app`: :class:`~moe_rl.serve.app.SGLangProtocolApp`, the endpoints as
  ``(method, path, JSON body) -> (status, body)``, the pause gate and aborts;
  :mod:`.weights` its weight-update and memory endpoints; :mod:`.batcher` the micro-batching
  of concurrent per-sample requests.
- :mod:`.http`: FastAPI + uvicorn around the app (as SGLang's own server), api keys, and the
  ``moe-rl serve`` command line (:func:`~moe_rl.serve.http.build_arg_parser`).
- :mod:`.embedded`: the engine factory of ``moe-rl serve`` (HF checkpoint or recipe -> EmbeddedEngine,
  with the model's tokenizer).
- :mod:`.text`: the tokenizer side (text prompts, ``text`` in answers, stop strings, chat templates);
  :mod:`.openai`: the OpenAI-compatible ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``.
- :mod:`.limits`: body, batch and token limits, read timeout (their flags), and JSON without NaN;
  :mod:`.stall`: health, and the abort of an update session or pause abandoned by its trainer.

The same client, launcher and weight-sync code then run end to end on a CPU machine.
Requests and responses follow SGLang 0.5.23 (sgl-project/sglang), checked against its wheel:
``python/sglang/srt/entrypoints/http_server.py`` (paths, status codes, error bodies),
``python/sglang/srt/managers/io_struct.py`` (request fields and defaults),
``python/sglang/srt/managers/tokenizer_manager.py`` (meta_info keys) and
``python/sglang/srt/sampling/sampling_params.py`` (sampling fields) and
``python/sglang/srt/entrypoints/openai/protocol.py`` (the OpenAI endpoints). With the model's
tokenizer (the default of ``moe-rl serve``) ``/generate`` takes ``text`` and answers with ``text``
as SGLang does; with ``--skip-tokenizer-init`` (how the RL launcher starts servers) it is token ids
in, token ids out, no ``text``, and the OpenAI endpoints answer 400.

Ours, beyond SGLang: the begin/end weight-update session (0.5.23; misuse fails with SGLang's
messages, and distributed / tensor updates need it) is *atomic*: generation waits, updates are
staged, and ``/end_weight_update`` applies everything or nothing (``{"abort": true}`` discards).
``server_info`` advertises this as ``weight_update_session``.
Malformed requests get 400 with SGLang's ErrorResponse body naming the field; requests over a
limit get 413 (body) or 400 (prompts, tokens) naming the limit and its flag; non-finite weights
are refused (400 naming the tensor) and the served ones kept.
"""
