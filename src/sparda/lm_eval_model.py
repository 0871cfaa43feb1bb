"""``sparda.lm_eval_model``: an alias of :mod:`sparda.integrations.lm_eval`.

``python -m sparda.lm_eval_model --model sparda ...`` runs lm-eval's CLI with the model
``sparda`` registered; ``import sparda.lm_eval_model`` registers it (and binds this name
to that module itself).
"""

import sys

from sparda.integrations import lm_eval as _lm_eval

if __name__ == "__main__":
    _lm_eval.main()
else:
    sys.modules[__name__] = _lm_eval
