"""The install, the build, the README's commands, the example, the import graph."""
