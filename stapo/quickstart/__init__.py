"""The quickstart: a synthetic arithmetic task (:mod:`~stapo.quickstart.task`), tiny offline Qwen3 models and
tokenizers (:mod:`~stapo.quickstart.tiny`), and the run itself (:mod:`~stapo.quickstart.run`,
``python -m stapo.quickstart cpu|gpu``)."""
