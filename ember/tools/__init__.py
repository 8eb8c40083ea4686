"""Tools the model can call, behind the Toolset protocol."""
