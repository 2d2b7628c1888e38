"""LMI inputs at container start: serving.properties, OPTION_* variables, LMI names and recipes -> typed settings (torch-free)."""
