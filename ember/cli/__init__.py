"""The `ember` command: one module per command group; main.py assembles them."""
