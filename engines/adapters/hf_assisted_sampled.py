"""Audit target: Hugging Face assisted generation sampled, `generate(assistant_model=draft, do_sample=True)`.

The sampled audit's engine `hf-assisted` (`specaudit audit --temperature T --engine hf-assisted`):
transformers' own speculative sampler (`_speculative_sampling`, Leviathan et al.'s algorithm 1 on the
processed logits of target and assistant) on the installed transformers, one prompt at a time (every
5.x release refuses a batch here). The request's temperature, top-k and top-p are passed to
`generate` and every other processor is switched off (`top_k` 0 is off: transformers' default would
be 50; `min_p`, `typical_p`, the epsilon and eta cuts unset, no penalties). transformers applies them
in vLLM's order (temperature, top-k, top-p), to float32 casts of the logits: the float64 target the
audit computes differs by float32 rounding only, far below any TV a test here can detect.

transformers has no per-request seed: `generate` draws from torch's global stream, so each request
runs after `torch.manual_seed(its seed)` (the global stream is left as that request left it). The
draft proposes a constant `draft_tokens` per step (as `HFAssisted` sets it).

`last_speculation`: the candidates the target's verification passes scored and the tokens they
accepted, counted from the passes (a forward hook on the target: each pass after the first scores
its candidates plus one row; each pass emits its accepted candidates and one token of its own), so a
passing audit shows that the assistant's candidates were really verified.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from transformers import PreTrainedModel

from specaudit.engines.adapters._hf import cut_at_eos, hf_eos, patched_generation_config, resolve_pad_id
from specaudit.engines.sampling.process import SamplingParams


class _PassCounter:
    """The number of rows each forward pass of `model` returned logits for, inside a `with` block."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        self.rows: list[int] = []
        self._handle: Any = None

    def __enter__(self) -> "_PassCounter":
        def hook(_module: Any, _args: Any, output: Any) -> None:
            logits = getattr(output, "logits", None)
            if logits is not None:
                self.rows.append(int(logits.shape[1]))

        self._handle = self.model.register_forward_hook(hook)
        return self

    def __exit__(self, *_exc: object) -> None:
        self._handle.remove()


class HFAssistedSampled:
    """`target.generate(assistant_model=draft, do_sample=True, ...)` per prompt, seeded per request."""

    name = "hf-assisted"
    black_box = False

    def __init__(self, target: PreTrainedModel, draft: PreTrainedModel | None = None, *, temperature: float = 1.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int = 0, draft_tokens: int = 4,
                 pad_token_id: int | None = None, **_: object) -> None:
        if draft is None:
            raise ValueError("hf-assisted needs a draft model")
        if draft_tokens < 1:
            raise ValueError("draft_tokens must be at least 1")
        self.params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
        if self.params.greedy:
            raise ValueError("the sampled hf-assisted engine samples: give a temperature above 0")
        self.target, self.draft, self.seed, self.k = target, draft, int(seed), draft_tokens
        self.pad_id = resolve_pad_id(target, pad_token_id)
        self.last_speculation: dict[str, Any] | None = None

    def sampling_options(self) -> dict[str, Any]:
        """The `generate` options of the request's sampling, every other processor off."""
        return {"do_sample": True, "temperature": self.params.temperature, "top_k": self.params.top_k,
                "top_p": self.params.top_p, "min_p": None, "typical_p": 1.0, "epsilon_cutoff": 0.0,
                "eta_cutoff": 0.0, "repetition_penalty": 1.0, "num_beams": 1}

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, eos_token_id: int | Sequence[int] | None,
                 seeds: list[int] | None = None) -> list[list[int]]:
        from specaudit.engines.sampling.engine import request_seeds

        seeds = request_seeds(self.seed, len(prompts)) if seeds is None else seeds
        eos = hf_eos(eos_token_id)
        outputs: list[list[int]] = []
        drafted = accepted = passes = 0
        draft_options = dict(num_assistant_tokens=self.k, num_assistant_tokens_schedule="constant",
                             assistant_confidence_threshold=0.0)
        with patched_generation_config(self.draft, **draft_options), \
                patched_generation_config(self.target, eos_token_id=eos, pad_token_id=self.pad_id):
            for prompt, seed in zip(prompts, seeds):
                if max_new_tokens <= 0:
                    outputs.append([])
                    continue
                input_ids = torch.tensor([prompt], dtype=torch.long, device=self.target.device)  # [1, n]
                torch.manual_seed(int(seed))
                with _PassCounter(self.target) as counter:
                    out = self.target.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                               assistant_model=self.draft, max_new_tokens=max_new_tokens,
                                               min_new_tokens=0, eos_token_id=eos, pad_token_id=self.pad_id,
                                               **self.sampling_options())
                new = out[0, len(prompt):].tolist()
                kept = new[: cut_at_eos(new, eos, max_new_tokens)]
                outputs.append(kept)
                # the first pass scores the prompt (all its rows, or candidates + 1 with logits_to_keep)
                scored = [rows - 1 for rows in counter.rows[1:]]
                first = counter.rows[0] - 1 if counter.rows and counter.rows[0] - 1 <= self.k else 0
                drafted += first + sum(scored)
                accepted += max(0, len(kept) - len(counter.rows))
                passes += len(counter.rows)
        self.last_speculation = {"drafted_tokens": drafted, "accepted_tokens": accepted,
                                 "acceptance_rate": accepted / drafted if drafted else None, "preemptions": None,
                                 "source": f"the target's {passes} forward passes (candidates scored, tokens "
                                           "emitted beyond one per pass)"}
        return outputs
