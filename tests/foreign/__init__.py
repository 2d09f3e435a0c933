"""Small batched engines written the way people outside this project write them, to audit code
the diagnosis was not written against. Each module is one style; each has a correct variant and
buggy ones, every one a `factory(target, draft, *, batch_size, draft_tokens, **options)`.

- `padded_loop`: plain greedy, one left-padded batch, a DynamicCache and explicit 4-D masks;
- `generate_spec`: speculative, drafts from `draft.generate(...)` on a left-padded batch, then one
  target pass over the whole padded sequence (no target cache);
- `recompute_spec`: speculative with holes: rejected draft slots stay in the sequence, masked;
  no cache, the whole padded sequence recomputed every step;
- `row_cache_spec`: speculative, one DynamicCache per row kept in a list, rows stepped one by one;
- `server_batcher`: a continuous batcher (a request queue, slots, rows admitted and retired
  between steps) that recomputes the active rows as one left-padded batch;
- `generate_chunks`: plain greedy as a loop over `model.generate` calls of a few tokens each, the
  unfinished rows re-padded between calls, explicit position ids;
- `static_cache_spec`: speculative on preallocated `StaticCache`s written at a shared cache position,
  rejected proposals left in their columns as masked holes;
- `right_padded_loop`: plain greedy on a right-padded batch, new tokens appended at one shared column
  after the widest prompt (a gap of pads between a short prompt and its new tokens);
- `mask2d_spec`: speculative on one `DynamicCache` per model with 2-D masks (the library builds the 4-D
  ones), rejected proposals left as holes hidden by zeros in the 2-D mask.
"""
