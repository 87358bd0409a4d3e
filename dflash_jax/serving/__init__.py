"""Serving: the slot engine and the OpenAI-compatible server around it.

  slots.py          the host side of the slot engine (Slots: admission, pages, grammar fields, the
                    dispatch pipeline); generate(slots=N) runs offline through it
  slot_programs.py  its device programs (SlotPrograms: empty / insert / step, over dense rows or pages)
  pages.py          the page allocator and prefix index (PageAllocator, WindowPages)
  engine.py         the engines the server drives (SlotEngine, SimpleEngine) and their interface
  server.py         the FastAPI app and `python -m dflash_jax.serve`'s main (dflash_jax/serve.py runs it)
  multihost_serve.py  one engine over several hosts (process 0 serves, the others follow)
  grammar.py        structured output (llguidance): constraints the slot engine walks along the drafts
  scoring.py        prompt logprobs / echo scoring
"""
