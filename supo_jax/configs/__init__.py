"""Config files that ship with the package (each defines `config() -> Config`)."""
