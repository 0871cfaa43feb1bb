"""sparda inside other frameworks (docs/integrations.md).

* :mod:`sparda.integrations.hf` - sparda attention in a transformers model
  (``sparda.hf.enable(model, ...)``, ``sparda.hf`` is an alias);
* :mod:`sparda.integrations.lm_eval` - the lm-evaluation-harness model ``sparda``
  (``python -m sparda.lm_eval_model``, an alias that runs lm-eval's CLI).

Neither is imported here: each pulls in its framework.
"""
