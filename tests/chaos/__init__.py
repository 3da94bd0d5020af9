"""The chaos run: ``python -m tests.chaos.run [--full] [--seed N]`` (``make chaos``).

``faults`` holds the infrastructure faults it injects (also used by
tests/behaviour/test_infrastructure_faults.py), ``run`` the driver.
"""
