"""The torch frontend: array namespace (``array_api``) and the Triton launch (``triton_launch``)."""
