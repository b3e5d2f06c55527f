"""dcpkit inside the training frameworks people use, each an optional extra of its own:
``dcpkit.integrations.accelerate`` (``pip install dcpkit[accelerate]``) and
``dcpkit.integrations.lightning`` (``pip install dcpkit[lightning]``). Importing this package
imports no framework."""
