"""The `bench` pair: real proportions, random weights, and a drafter with a chosen acceptance.

`--pair bench` is a Qwen3-style target of about 316M parameters (hidden 1024, 24 layers, 16
query / 8 key-value heads, MLP 2816, a 32,000-token vocabulary, tied embeddings) and a draft of
about 11M (hidden 256, 4 layers, same vocabulary). Both are built from these configs and filled
from seeded `torch.Generator`s; nothing is downloaded. They speak the byte tokenizer of the tiny
pairs (ids 0..255 are UTF-8 bytes, then `<pad>`, `<bos>`, `<eos>`); the other ids are never in
a prompt but can be generated, and every output layer pays for all 32,000.

Random draft weights accept nothing, so speed is measured with a calibrated drafter:

- `CalibratedChooser` holds, per prompt, the target's greedy continuation, computed once with
  `engines.reference.greedy_decode` before any timing (`continuations`). For a row that has
  emitted `g` new tokens, draft token `i` (0-based) is the continuation's token `g + i` with
  probability `acceptance` (a seeded `torch.Generator`, one draw per proposed token), else a
  token the continuation does not hold there. Because verification keeps the longest correct
  prefix, a row accepts `a` tokens with probability `acceptance^a (1 - acceptance)` (`a < k`)
  and all `k` with `acceptance^k`: the expected tokens per step is `(1 - A^(k+1)) / (1 - A)`.
- The lookup costs no target pass: the continuation is a table read by row position. A row whose
  pending token leaves its continuation (possible below float64, where a batched pass can flip a
  near-tie that batch size 1 did not) is marked off and from then on gets the draft model's own
  greedy tokens; `CalibratedChooser.diverged_rows` counts them and the bench reports it.
- `CalibratedDrafter` (ragged engines: EQSPEC, EXSPEC) and `engines.inplace.InplaceDrafter` with a
  chooser run the draft model for every proposed token exactly as greedy drafting would (k
  passes, plus the fill pass when a row accepted all k), feeding it the chosen tokens, so the
  draft costs what it costs and its cache holds what the row accepted.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel, Qwen3Config

from specaudit.engines.drafters import Chooser, ModelDrafter
from specaudit.engines.models.attention import use_sdpa_gqa
from specaudit.engines.models.pair import DTYPES, ByteTokenizer, ModelPair, prepare_model
from specaudit.engines.reference import greedy_decode

BENCH_VOCAB_SIZE = 32_000
BENCH_SEED = 2026
TARGET_SHAPE: dict[str, Any] = dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                                    num_key_value_heads=8, head_dim=64, intermediate_size=2816)
DRAFT_SHAPE: dict[str, Any] = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=64, intermediate_size=768)
# std of every weight matrix; the embedding (tied output layer) gets a larger one so the target's
# top-2 logits are rarely near a tie (fewer low-precision flips between batch shapes)
MATRIX_STD = 0.02
EMBEDDING_STD = 0.5
DEFAULT_ACCEPTANCE = 0.8  # per-token; near the draft/target agreement the paper reports


def bench_config(shape: dict[str, Any]) -> Qwen3Config:
    return Qwen3Config(
        vocab_size=BENCH_VOCAB_SIZE, max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=True,
        pad_token_id=ByteTokenizer.pad_token_id, bos_token_id=ByteTokenizer.bos_token_id,
        eos_token_id=ByteTokenizer.eos_token_id, **shape,
    )


def _seeded_model(shape: dict[str, Any], seed: int, dtype: torch.dtype) -> PreTrainedModel:
    model = AutoModelForCausalLM.from_config(bench_config(shape), dtype=dtype)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if param.dim() == 2:
                std = EMBEDDING_STD if "embed_tokens" in name else MATRIX_STD
                param.copy_(torch.randn(param.shape, generator=gen, dtype=torch.float32) * std)
    return model


def load_bench_pair(dtype: str | torch.dtype = "float32", device: str = "cpu"):
    """The `bench` pair as a `ModelPair` on `device` in `dtype` (built in float32, then cast)."""
    torch_dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    target = _seeded_model(TARGET_SHAPE, BENCH_SEED, torch.float32)
    draft = _seeded_model(DRAFT_SHAPE, BENCH_SEED + 1, torch.float32)
    tok = ByteTokenizer()
    models = [prepare_model(model, torch_dtype, device) for model in (target, draft)]
    gqa = [use_sdpa_gqa(model) for model in models]  # on the CPU: key/value heads never repeated (models/attention.py)
    return ModelPair(
        name="bench", target=models[0], draft=models[1], tokenizer=tok, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        info={"family": "qwen3", "seed": BENCH_SEED,
              "target_parameters": sum(p.numel() for p in models[0].parameters()),
              "draft_parameters": sum(p.numel() for p in models[1].parameters()),
              "attention": "sdpa, grouped-query heads not repeated" if all(gqa) else "sdpa"},
    )


def expected_tokens_per_step(acceptance: float, k: int) -> float:
    """Accepted + bonus tokens per step when each draft token is right with probability `acceptance`."""
    if acceptance >= 1.0:
        return float(k + 1)
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


@torch.no_grad()
def continuations(target: PreTrainedModel, prompts: list[list[int]], max_new_tokens: int,
                  eos_token_id: int | None) -> list[list[int]]:
    """Each prompt's greedy continuation, one prompt at a time (the reference decoder's output)."""
    return [greedy_decode(target, prompt, max_new_tokens, eos_token_id)[0] for prompt in prompts]


class CalibratedChooser(Chooser):
    """Chooses each draft token: the target's greedy token with probability `acceptance`, else another.

    Everything lives on `device` (the continuation table, the random draws, which requests have left
    their continuation), so choosing reads nothing on the host: the fixed-shape path takes it as is
    (`on_device`), and a step pays no host read for it."""

    on_device = True

    def __init__(self, continuations: list[list[int]], acceptance: float, vocab_size: int, seed: int = 0,
                 device: str | torch.device = "cpu") -> None:
        if not 0.0 <= acceptance <= 1.0:
            raise ValueError(f"acceptance must be within [0, 1], got {acceptance}")
        width = max((len(c) for c in continuations), default=0) + 1
        # [P, width]: continuation tokens, -1 past the end (no target token there: any proposal is fine)
        table = torch.full((len(continuations), width), -1, dtype=torch.long)
        for p, tokens in enumerate(continuations):
            table[p, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        self.device = torch.device(device)
        self.table = table.to(self.device)
        self.acceptance = acceptance
        self.vocab_size = vocab_size
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.diverged = torch.zeros(len(continuations), dtype=torch.bool, device=self.device)  # [P]
        self._rows: torch.Tensor | None = None
        self._generated: torch.Tensor | None = None
        self._right: torch.Tensor | None = None
        self._other: torch.Tensor | None = None

    @property
    def diverged_rows(self) -> int:
        return int(self.diverged.sum())  # read once, after the run

    def begin(self, rows: list[int] | torch.Tensor, generated: torch.Tensor, pending: torch.Tensor, k: int) -> None:
        """Start a step: `rows` [B] the request of each row (-1: an idle slot), `generated` [B] new tokens so
        far per row (pending one included), `pending` [B]."""
        rows_t = torch.as_tensor(rows, dtype=torch.long).to(self.device)
        known = rows_t >= 0  # [B]
        safe = rows_t.clamp(min=0)
        generated = generated.to(self.device)
        expected = self.table[safe, (generated - 1).clamp(min=0, max=self.table.shape[1] - 1)]  # [B]
        left = known & (expected != pending.to(self.device))  # the row no longer follows its continuation
        hits = torch.zeros(self.diverged.shape, dtype=torch.long, device=self.device).index_put_(
            (safe,), left.long(), accumulate=True)  # idle slots (clamped to request 0) add nothing
        self.diverged |= hits > 0  # sticky per request
        self._rows, self._generated = safe, generated
        self._right = torch.rand(len(rows_t), k, generator=self.generator, device=self.device) < self.acceptance
        self._other = torch.randint(1, self.vocab_size, (len(rows_t), k), generator=self.generator, device=self.device)

    def choose(self, i: int, draft_greedy: torch.Tensor) -> torch.Tensor:
        """Draft token `i` per row [B]; `draft_greedy` [B] is the draft model's own choice (used when
        the continuation is unknown for the row)."""
        assert self._rows is not None and self._generated is not None and self._right is not None
        column = (self._generated + i).clamp(max=self.table.shape[1] - 1)
        truth = self.table[self._rows, column]  # [B]
        wrong = (truth + self._other[:, i]) % self.vocab_size  # never equals truth
        chosen = torch.where(self._right[:, i], truth, wrong)
        unknown = (truth < 0) | self.diverged[self._rows]
        return torch.where(unknown, draft_greedy.to(self.device), chosen).to(draft_greedy.device)


class CalibratedDrafter(ModelDrafter):
    """The `Drafter` of the ragged engines (EQSPEC, EXSPEC): `ModelDrafter` (its k passes on a ragged
    batch, the fill pass, the recurrent commit and the draft checks) with its proposals chosen by a
    `CalibratedChooser`; `fill_seconds` adds up its fill passes."""

    def __init__(self, draft: PreTrainedModel, chooser: CalibratedChooser, shared_vocab_size: int | None = None) -> None:
        super().__init__(draft, shared_vocab_size, chooser=chooser)
