"""Sample listener modules deployed by settings.example.toml."""
