"""``sparda.hf``: an alias of :mod:`sparda.integrations.hf` (the documented entry point,
``sparda.hf.enable(model, ...)``). Importing it binds this name to that module itself, so
``sparda.hf.X`` reads and sets the module's own attributes."""

import sys

from sparda.integrations import hf as _hf

sys.modules[__name__] = _hf
