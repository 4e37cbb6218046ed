"""Drop-in integrations with training frameworks (optional extras, imported lazily).

- :mod:`ldformat.integrations.transformers`: ``LdformatCallback`` for Hugging Face ``Trainer``
  (``pip install ldformat[hf]``).
- :mod:`ldformat.integrations.lightning`: ``LdformatCheckpoint`` for Lightning
  (``pip install ldformat[lightning]``).

accelerate needs no module: :class:`ldformat.Checkpointer` unwraps the objects that
``accelerator.prepare`` returns.
"""
