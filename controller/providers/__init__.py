"""Providers: what each kind of server is (argv, image, environment, probe settings,
capabilities) and how a slot becomes its launch.

``base`` the provider protocol and the build context; ``templates`` each provider's
template (llama.cpp, vLLM, SGLang, the demo server, speech servers...); ``launch`` the
registry, :func:`~controller.providers.launch.build_launch` and the one launch hash the
manager and ``stack diff``/``apply`` share; ``quadlet`` a slot as a podman unit.
"""
