"""Speculative decoding without a draft model: guesses taken from text already seen (``ngram``,
``suffix``), proposed by a ``Drafter`` each step, verified by the model in one chunk per request,
and rolled back where they were wrong (``engine/scheduler.py``, ``kvcache/manager.py``'s ``trim``).
No torch here."""
