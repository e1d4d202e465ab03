"""A server's command line -> a slotctl provider, its model's source and the slot's fields.

What it recognises (the rest runs as ``openai-compatible`` with the command as
``server.cmd``):

- ``llama-server …`` (any path or suffix: ``/opt/llama-server-ec9e0301``) -> ``llamacpp``;
- ``vllm serve MODEL …`` -> ``vllm``;
- ``python -m llama_cpp.server …`` -> ``llama-cpp-python``;
- ``python -m controller.demo …`` -> ``demo`` (slotctl's own demo server);
- ``docker|podman run [options] IMAGE [args]`` of a llama.cpp server image
  (``ghcr.io/ggml-org/llama.cpp:server…``) or vLLM's (``vllm/vllm-openai``) -> that
  provider with ``server.image``, the model path read through the ``-v`` mounts.

Flags are read from each engine's documented options (llama-server: its README's
"common params" table; vLLM: ``vllm serve --help``'s engine arguments). What slotctl
sets itself (``--port``, ``--host``, GPU layers and split, ``--alias`` /
``--served-model-name``, device visibility) is taken out and reported as ``owned``; what
a model owns (context, chat template, projector, sampling defaults) moves to the
``[[model]]``; the rest stays, in order, in ``server.extra_args``. The stack guard's own
tables (:data:`~controller.spec.schema.HARDWARE_FLAGS`,
:data:`~controller.spec.schema.MODEL_OWNED_FLAGS`) are applied last, so nothing it would
refuse is left behind.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from controller.importers.argv import ArgList, flag_name
from controller.importers.hub import HubRef, Lister, choose_file, parse_hf, projector
from controller.importers.report import ImportReport
from controller.spec.schema import HARDWARE_ENV_VARS, HARDWARE_FLAGS, MODEL_OWNED_FLAGS

__all__ = ["PORT_TOKEN", "ServerImport", "device_from_visibility", "import_server"]

# What llama-swap's ${PORT} expands to: the slot's port, which slotctl chooses.
PORT_TOKEN: Final = "{port}"  # noqa: S105 (a template placeholder, not a secret)

_SAMPLING_FLAGS: Final[dict[str, tuple[str, type]]] = {
    "--temp": ("temperature", float),
    "--top-k": ("top_k", int),
    "--top-p": ("top_p", float),
    "--min-p": ("min_p", float),
    "--repeat-penalty": ("repeat_penalty", float),
    "--presence-penalty": ("presence_penalty", float),
    "--frequency-penalty": ("frequency_penalty", float),
}
_ALL_LAYERS: Final = frozenset({"all", "auto", "99", "999", "9999", "-1"})
_API_KEY_FLAGS: Final = ("--api-key", "--api-key-file")
_ROUTER_FLAGS: Final = (
    "--models-preset",
    "--models-dir",
    "--models-max",
)
_ROUTER_SWITCHES: Final = ("--models-autoload", "--no-models-autoload")

# docker run options that take a value (docker run reference); the rest are switches.
_DOCKER_VALUED: Final = frozenset(
    {
        "-p", "--publish", "-v", "--volume", "-e", "--env", "--env-file", "--name", "--gpus",
        "--runtime", "--shm-size", "--network", "--net", "-w", "--workdir", "--entrypoint",
        "-u", "--user", "--ipc", "--mount", "-l", "--label", "--ulimit", "--device", "--cpus",
        "-m", "--memory", "-h", "--hostname", "--restart", "--platform", "--pull",
        "--cap-add", "--cap-drop", "--security-opt", "--add-host", "--group-add",
        "--log-driver", "--log-opt", "--pid", "--tmpfs", "--stop-timeout", "--stop-signal",
        "--memory-swap", "--cpuset-cpus",
    }
)  # fmt: skip
# Options slotctl's docker runtime sets itself for each slot container.
_DOCKER_OWNED: Final = frozenset(
    {"-p", "--publish", "--name", "--rm", "--init", "-d", "--detach", "-i", "-t", "-it",
     "--interactive", "--tty", "-v", "--volume", "--gpus", "--runtime", "--restart"}
)  # fmt: skip


@dataclass(slots=True)
class ServerImport:
    """What one server command becomes."""

    provider: str
    model: dict[str, Any] = field(default_factory=dict)  # [[model]] fields besides id
    slot: dict[str, Any] = field(default_factory=dict)  # [[slot]] fields: device, port, type
    server: dict[str, Any] = field(default_factory=dict)  # [slot.server]


@dataclass(slots=True)
class _Docker:
    image: str
    args: list[str]
    env: dict[str, str]
    mounts: list[tuple[str, str]]  # (host, container)
    gpus: str | None


def device_from_visibility(name: str, value: str) -> str | None:
    """``CUDA_VISIBLE_DEVICES=0,1`` -> ``gpu:0,1``; ``""``/``-1`` -> ``cpu``; None when the
    value names no GPU slotctl can pin (``all``, MIG instances)."""
    value = value.strip()
    if value in ("", "-1", "none", "void"):
        return "cpu"
    if value == "all":
        return "gpu"
    parts = [p.strip() for p in value.split(",") if p.strip()]
    if parts and all(re.fullmatch(r"[0-9]+|GPU-[0-9A-Za-z-]+", p) for p in parts):
        return "gpu:" + ",".join(parts)
    return None


def import_server(
    argv: Sequence[str],
    *,
    env: Mapping[str, str],
    key: str,
    report: ImportReport,
    lister: Lister | None = None,
    cmd_key: str | None = None,
) -> ServerImport:
    """``argv`` (macros expanded; ``${PORT}`` as :data:`PORT_TOKEN`) and its environment
    as a provider with its model and slot fields; findings under ``key`` (``models.X``:
    ``models.X.env: NAME``), its flags' under ``cmd_key`` (default ``models.X.cmd``:
    ``models.X.cmd: --flag``)."""
    argv = list(argv)
    env_key, key = key, cmd_key or f"{key}.cmd"
    docker = _docker_run(argv, key, report) if _is_container_run(argv) else None
    env = dict(env)
    if docker is not None:
        env.update(docker.env)
        argv = docker.args
    out = _recognise(argv, docker)
    args = ArgList(out.server.pop("args"))
    if out.provider == "llamacpp":
        _llama_server(args, out, key, report, lister)
    elif out.provider == "vllm":
        _vllm(args, out, key, report)
    elif out.provider == "llama-cpp-python":
        _llama_cpp_python(args, out, key, report)
    elif out.provider == "demo":
        _demo(args, out, key, report)
    if out.provider == "openai-compatible":
        out.server["cmd"] = list(args.items)
        if PORT_TOKEN not in " ".join(args.items):
            report.add(
                key,
                "approximated",
                "the command takes no ${PORT}: slotctl cannot tell it which port to listen "
                "on, so the slot declares the port the server uses (from `proxy`)",
            )
    else:
        _screen(args, out, key, report)
        if args.items:
            out.server["extra_args"] = list(args.items)
    if docker is not None:
        _docker_model_path(out, docker, key, report)
        out.slot.pop("port", None)  # the container's own port, not the host's (proxy's)
    _relative_source(out, key, report)
    if out.provider in ("llamacpp", "vllm", "llama-cpp-python") and not out.model.get("source"):
        report.add(
            key,
            "needs-input",
            f"the command names no model ({out.provider} needs one): set the model's source",
        )
    _environment(env, out, env_key, report)
    return out


# ------------------------------------------------------------------ recognising


def _is_container_run(argv: Sequence[str]) -> bool:
    return (
        len(argv) > 2 and posixpath.basename(argv[0]) in ("docker", "podman") and argv[1] == "run"
    )


def _docker_run(argv: list[str], key: str, report: ImportReport) -> _Docker:
    env: dict[str, str] = {}
    mounts: list[tuple[str, str]] = []
    gpus: str | None = None
    i = 2
    while i < len(argv) and argv[i].startswith("-"):
        arg = argv[i]
        name, eq, inline = arg.partition("=")
        valued = name in _DOCKER_VALUED and not eq
        value = inline if eq else (argv[i + 1] if valued and i + 1 < len(argv) else None)
        i += 2 if valued else 1
        if name in ("-e", "--env") and value and "=" in value:
            k, _, v = value.partition("=")
            env[k] = v
        elif name in ("-v", "--volume") and value:
            host, _, rest = value.partition(":")
            mounts.append((host, rest.split(":", 1)[0]))
        elif name == "--gpus" and value is not None:
            gpus = value
        if name in ("-e", "--env"):
            continue
        if name in _DOCKER_OWNED:
            report.add(
                f"{key}: {arg}",
                "owned",
                "slotctl's docker runtime names, publishes, mounts and removes each slot's "
                "container itself, and gives it the GPUs it places the slot on",
            )
        else:
            report.add(
                f"{key}: {name}",
                "dropped",
                f"docker run option {name!r}: slotctl's docker runtime does not take "
                "per-slot container options",
            )
    if i >= len(argv):
        return _Docker("", [], env, mounts, gpus)
    report.add(
        key,
        "approximated",
        f"the server ran in a container ({argv[i]}): the slot keeps server.image, used by "
        "`slotctl up --runtime docker`; the process runtime runs the provider's binary",
    )
    return _Docker(argv[i], argv[i + 1 :], env, mounts, gpus)


def _recognise(argv: list[str], docker: _Docker | None) -> ServerImport:
    if docker is not None:
        image = docker.image.lower()
        provider = (
            "llamacpp"
            if "llama.cpp" in image or "llama-cpp" in image
            else "vllm"
            if "vllm" in image
            else "openai-compatible"
        )
        server: dict[str, Any] = {"image": docker.image, "args": argv}
        if docker.gpus is not None:
            server["gpus"] = docker.gpus
        if provider == "openai-compatible":  # the image's own entrypoint: argv is its args
            return ServerImport(provider, server={"image": docker.image, "args": argv})
        return ServerImport(provider, server=server)
    base = posixpath.basename(argv[0])
    if base.startswith("llama-server"):
        server = {"args": argv[1:]}
        if argv[0] != "llama-server":
            server["binary"] = argv[0]
        return ServerImport("llamacpp", server=server)
    if base == "vllm" and len(argv) > 1 and argv[1] == "serve":
        server = {"args": argv[2:]}
        if argv[0] != "vllm":
            server["binary"] = argv[0]
        return ServerImport("vllm", server=server)
    if base.startswith("python") and len(argv) > 2 and argv[1] == "-m":
        module = argv[2]
        if module == "llama_cpp.server":
            return ServerImport("llama-cpp-python", server={"binary": argv[0], "args": argv[3:]})
        if module == "controller.demo":
            return ServerImport("demo", server={"binary": argv[0], "args": argv[3:]})
    return ServerImport("openai-compatible", server={"args": argv})


# ------------------------------------------------------------------ providers


def _owned(report: ImportReport, key: str, flag: str, reason: str) -> None:
    report.add(f"{key}: {flag}", "owned", reason)


def _port(args: ArgList, out: ServerImport, key: str, report: ImportReport) -> None:
    port = args.last(["--port"])
    host = args.take(["--host"])
    if port is not None and port != PORT_TOKEN:
        if port.isdigit() and 0 < int(port) < 65536:
            out.slot["port"] = int(port)
        else:
            report.add(f"{key}: --port", "needs-input", f"port {port!r} is not a number")
    if port is not None:
        _owned(report, key, "--port", "slotctl passes the slot's port to the server")
    if host:
        _owned(report, key, "--host", "slotctl binds the server to its own host (127.0.0.1)")


def _gpu_layers(value: str | None, out: ServerImport, key: str, report: ImportReport) -> None:
    if value is None:
        return
    if value == "0":
        out.slot["device"] = "cpu"
        _owned(report, key, "--n-gpu-layers", "0 layers on a GPU: the slot runs on device = cpu")
    elif value.lower() in _ALL_LAYERS:
        _owned(report, key, "--n-gpu-layers", "slotctl offloads every layer on a GPU slot")
    else:
        report.add(
            f"{key}: --n-gpu-layers",
            "approximated",
            f"{value} layers on the GPU: slotctl offloads every layer of a GPU slot (partial "
            "offload has no slotctl setting)",
        )


def _hf_source(
    ref: HubRef, out: ServerImport, key: str, report: ImportReport, lister: Lister | None
) -> None:
    if ref.file:
        out.model["source"] = f"hf://{ref.repo}/{ref.file}"
        return
    files: Sequence[str] | None = None
    error = "offline"
    if lister is not None:
        try:
            files = list(lister(ref.repo))
        except Exception as exc:  # noqa: BLE001 (any failure of the hub is reported)
            error = f"{type(exc).__name__}: {exc}"
    chosen = choose_file(ref, files) if files is not None else None
    tag = ref.quant or "Q4_K_M (the default)"
    if chosen is None:
        out.model["source"] = f"hf://{ref.repo}"
        report.add(
            f"{key}: -hf",
            "needs-input",
            f"{ref.repo}:{tag} names no file slotctl could resolve "
            f"({'no such file in the repository' if files is not None else error}): set the "
            f"model's source to hf://{ref.repo}/FILE.gguf",
        )
        return
    out.model["source"] = f"hf://{ref.repo}/{chosen}"
    report.add(
        f"{key}: -hf",
        "approximated",
        f"{ref.repo}:{tag} resolved to {chosen} from the repository's listing (llama-server's "
        "rule: the quant, case-insensitive, else the first file); pin it with `revision` "
        "to keep it from changing",
    )
    mmproj = projector(files or [])
    if mmproj is not None:
        report.add(
            f"{key}: -hf",
            "needs-input",
            f"llama-server also downloads the projector {mmproj}; slotctl pulls one file: "
            "pull it and set the model's mmproj to its path",
        )


def _llama_server(
    args: ArgList, out: ServerImport, key: str, report: ImportReport, lister: Lister | None
) -> None:
    model = args.last(["-m", "--model"])
    url = args.last(["-mu", "--model-url"])
    repo = args.last(["-hf", "-hfr", "--hf-repo"])
    hf_file = args.last(["-hff", "--hf-file"])
    if model is not None:
        out.model["source"] = model
    elif repo is not None:
        ref = parse_hf(repo, hf_file)
        if ref is None:
            report.add(f"{key}: -hf", "needs-input", f"{repo!r} names no user/model")
        else:
            _hf_source(ref, out, key, report, lister)
    elif url is not None:
        out.model["source"] = url
        report.add(
            f"{key}: --model-url",
            "needs-input",
            "an https:// source needs its sha256 in the stack (nothing else vouches for its "
            'bytes): add sha256 = "<64 hex digits>" to the model',
        )
    _context(args.last(["-c", "--ctx-size"]), out, key, report)
    _model_keys(args, out, key, report)
    _port(args, out, key, report)
    if args.take(["-a", "--alias"]):
        _owned(report, key, "--alias", "slotctl names the served model by its id (--alias)")
    _gpu_layers(args.last(["-ngl", "--gpu-layers", "--n-gpu-layers"]), out, key, report)
    device = args.last(["-dev", "--device"])
    if device is not None:
        if device == "none":
            out.slot["device"] = "cpu"
        _owned(report, key, "--device", "slotctl chooses the devices from the slot's device")
    for names, flag in (
        (["-sm", "--split-mode"], "--split-mode"),
        (["-ts", "--tensor-split"], "--tensor-split"),
        (["-mg", "--main-gpu"], "--main-gpu"),
    ):
        if args.take(names):
            _owned(report, key, flag, "slotctl splits a slot over the GPUs it places it on")
    if args.flag(["--embedding", "--embeddings"]):
        out.slot["type"] = "embedding"
        out.model["kind"] = "embedding"
    _api_key(args, key, report)
    for flag in _ROUTER_FLAGS:
        if args.take([flag]):
            _router_mode(report, key, flag)
    for flag in _ROUTER_SWITCHES:
        if args.flag([flag]):
            _router_mode(report, key, flag)


def _router_mode(report: ImportReport, key: str, flag: str) -> None:
    report.add(
        f"{key}: {flag}",
        "dropped",
        "llama-server's router mode inside one slot: import its presets file instead "
        "(`slotctl import --from llama-server-presets FILE.ini`), one slot per model",
    )


def _api_key(args: ArgList, key: str, report: ImportReport) -> None:
    if args.take(_API_KEY_FLAGS):
        report.add(
            f"{key}: --api-key",
            "owned",
            "slotctl's router checks the clients' keys (`slotctl key create`); the server "
            "behind it answers slotctl's probes without one",
        )


def _context(value: str | None, out: ServerImport, key: str, report: ImportReport) -> None:
    if value is None:
        return
    if value.isdigit() and int(value) > 0:
        out.model["context_length"] = int(value)
    else:
        report.add(
            f"{key}: --ctx-size",
            "approximated",
            f"context {value!r} (0: the model's own) has no slotctl form: the server runs "
            "with its default context unless the model sets context_length",
        )


def _model_keys(args: ArgList, out: ServerImport, key: str, report: ImportReport) -> None:
    template = args.last(["--chat-template"])
    if template is not None:
        out.model["chat_template"] = template
    mmproj = args.last(["-mm", "--mmproj"])
    if mmproj is not None:
        out.model["mmproj"] = mmproj
    for flag, (name, kind) in _SAMPLING_FLAGS.items():
        value = args.last([flag])
        if value is None:
            continue
        try:  # the model's sampling default: the llamacpp provider passes it back
            out.model[name] = kind(value)  # to llama-server as this flag (providers.sampling)
        except ValueError:
            report.add(f"{key}: {flag}", "needs-input", f"{value!r} is not a {kind.__name__}")


def _vllm(args: ArgList, out: ServerImport, key: str, report: ImportReport) -> None:
    model = args.last(["--model"])
    if model is None and args.items and flag_name(args.items[0]) is None:
        model = args.items.pop(0)
    if model is not None:
        out.model["source"] = _vllm_source(model, key, report)
    max_len = args.last(["--max-model-len"])
    if max_len is not None:
        _context(max_len, out, key, report)
    template = args.last(["--chat-template"])
    if template is not None:
        out.model["chat_template"] = template
    task = args.last(["--task"])
    if task == "embed":
        out.slot["type"] = "embedding"
        out.model["kind"] = "embedding"
    elif task is not None:
        args.items += ["--task", task]
    if args.take(["--served-model-name"]):
        _owned(report, key, "--served-model-name", "slotctl serves the model by its id")
    tp = args.last(["-tp", "--tensor-parallel-size"])
    if tp is not None and tp.isdigit() and int(tp) > 1:
        out.slot["gpus"] = int(tp)
        _owned(report, key, "--tensor-parallel-size", f"the slot spans gpus = {tp}")
    if args.take(["--gpu-memory-utilization"]):
        _owned(
            report,
            key,
            "--gpu-memory-utilization",
            "slotctl sets it from the memory the slot is admitted with (its memory_gb, else "
            "the footprint estimated from the model)",
        )
    _port(args, out, key, report)
    _api_key(args, key, report)


def _vllm_source(model: str, key: str, report: ImportReport) -> str:
    """vLLM's model: a local path, or a hub repository id (``org/name``)."""
    if model.startswith(("/", "./", "../", "~")):
        return model
    if re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", model):
        report.add(
            f"{key}: --model",
            "approximated",
            f"{model!r} read as a Hugging Face repository (hf://{model}); if it is a "
            "directory relative to the server's working directory, make it absolute",
        )
        return f"hf://{model}"
    return model


def _llama_cpp_python(args: ArgList, out: ServerImport, key: str, report: ImportReport) -> None:
    model = args.last(["--model"])
    if model is not None:
        out.model["source"] = model
    _context(args.last(["--n_ctx"]), out, key, report)
    fmt = args.last(["--chat_format"])
    if fmt is not None:
        out.model["chat_template"] = fmt
    if args.take(["--model_alias"]):
        _owned(report, key, "--model_alias", "slotctl serves the model by its id")
    _gpu_layers(args.last(["--n_gpu_layers"]), out, key, report)
    if args.take(["--split_mode", "--main_gpu", "--tensor_split"]):
        _owned(report, key, "--split_mode", "slotctl splits a slot over the GPUs it places it on")
    embedding = args.last(["--embedding"])
    if embedding is not None and embedding.lower() in ("true", "1"):
        out.slot["type"] = "embedding"
        out.model["kind"] = "embedding"
    _port(args, out, key, report)
    _api_key(args, key, report)


def _demo(args: ArgList, out: ServerImport, key: str, report: ImportReport) -> None:
    if args.take(["--model"]):
        _owned(report, key, "--model", "slotctl passes the model id to the demo server")
    _port(args, out, key, report)


def _screen(args: ArgList, out: ServerImport, key: str, report: ImportReport) -> None:
    """The stack guard's tables, last: anything it would refuse in extra_args."""
    for name in sorted(set(args.names())):
        if name in HARDWARE_FLAGS:
            args.take([name])
            _owned(report, key, name, "a placement flag: slotctl sets it from the slot's device")
        elif name in MODEL_OWNED_FLAGS:
            value = args.last([name])
            owner = MODEL_OWNED_FLAGS[name]
            if owner == "context_length":
                _context(value, out, key, report)
            else:
                report.add(
                    f"{key}: {name}",
                    "dropped",
                    f"the model owns {owner}; set it on the [[model]]",
                )


def _docker_model_path(out: ServerImport, docker: _Docker, key: str, report: ImportReport) -> None:
    """A model path inside the container, read as the host path it is mounted from."""
    gpus = out.server.pop("gpus", None)
    if isinstance(gpus, str):
        _docker_gpus(gpus, out)
    source = out.model.get("source")
    if not isinstance(source, str) or "://" in source:
        return
    for host, inside in sorted(docker.mounts, key=lambda m: -len(m[1])):
        if inside and (source == inside or source.startswith(inside.rstrip("/") + "/")):
            out.model["source"] = host.rstrip("/") + source[len(inside.rstrip("/")) :]
            return
    report.add(
        f"{key}: --model",
        "needs-input",
        f"{source!r} is a path inside the container that no -v mount maps: set the "
        "model's source to the file's path on the host",
    )


def _relative_source(out: ServerImport, key: str, report: ImportReport) -> None:
    """A relative model path was relative to the server's working directory; slotctl
    resolves it under its models dir."""
    source = out.model.get("source")
    if not isinstance(source, str) or "://" in source or source.startswith("/"):
        return
    if source.startswith("~"):
        report.add(
            f"{key}: --model",
            "needs-input",
            f"{source!r}: slotctl does not expand ~: write the absolute path",
        )
        return
    report.add(
        f"{key}: --model",
        "approximated",
        f"{source!r} is relative: slotctl resolves it under its models dir "
        "($SLOTCTL_MODELS_DIR, default /models), not the server's working directory",
    )


def _docker_gpus(value: str, out: ServerImport) -> None:
    """``--gpus all`` -> any GPU; ``--gpus 2`` -> gpus = 2; ``--gpus '"device=0,1"'`` ->
    device = gpu:0,1 (docker's GPU request syntax)."""
    value = value.strip().strip("'\"")
    if value.isdigit() and int(value) > 1:
        out.slot["gpus"] = int(value)
    elif value.startswith("device="):
        device = device_from_visibility("", value.removeprefix("device="))
        if device is not None and device.startswith("gpu:"):
            out.slot["device"] = device


def _environment(env: Mapping[str, str], out: ServerImport, key: str, report: ImportReport) -> None:
    kept: dict[str, str] = {}
    for name, value in env.items():
        if name in HARDWARE_ENV_VARS:
            device = device_from_visibility(name, value)
            if device is not None:
                if device != "gpu" or "device" not in out.slot:  # `all` pins nothing
                    out.slot["device"] = device
                report.add(f"{key}.env: {name}", "owned", f"the slot's device = {device!r}")
            else:
                report.add(
                    f"{key}.env: {name}",
                    "approximated",
                    f"{name}={value!r} names no GPU slotctl pins: the slot runs on any GPU",
                )
        else:
            kept[name] = value
    if kept:
        out.server["env"] = kept
