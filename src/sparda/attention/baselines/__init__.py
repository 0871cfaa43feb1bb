"""The seeds' baseline selectors at sparda's block budget (docs/baselines.md): ``infinigen``,
``streaming``, ``h2o``, ``quest``, ``snapkv`` and ``shallow``, one file each."""
