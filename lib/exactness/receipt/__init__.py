"""The receipt harness: the section table, typed parameters, profiles, the runner, rendering, the command line."""
