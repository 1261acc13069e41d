"""python -m watchdog.config > config.example.yaml"""

from watchdog.config.loading import example_yaml

print(example_yaml(), end="")
