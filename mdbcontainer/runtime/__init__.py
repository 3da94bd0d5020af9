"""The running container: listener ports, the container, its HTTP endpoints, the supervisor."""
