"""The state: the container's tables in the user's database, metrics, the application's tables."""
