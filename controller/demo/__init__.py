"""The demo model server: a small, real OpenAI-compatible server with fault knobs.

Where it sits: ``controller/demo/`` is a leaf of the package. It imports only the standard
library (not even asyncio: it starts in a few tens of milliseconds of CPU), never the rest
of ``controller``, so it runs anywhere a Python 3.11 interpreter can see this package.

Who calls it: the ``demo`` provider starts it as a child process
(``python -m controller.demo --host H --port P --model ID [knobs]``); it is the
zero-dependency provider behind ``slotctl up examples/quickstart`` and the fault injector
of the integration and e2e tests (slow loads, failed loads, hangs, an empty model list,
crashes while serving, slow stops). Benchmarks read its ``slotctl-demo ready ... t=``
line to measure how fast the controller notices a ready server.

Modules: ``config`` (command line, :class:`DemoConfig`), ``generate`` (deterministic
text and embeddings, pure), ``httpd`` (HTTP/1.1 on sockets and threads), ``api`` (the
OpenAI-compatible handlers) and ``server`` (the process lifecycle).
"""
