"""A run's configuration: typed frozen sections (`schema`), YAML + flag loading (`load`), and
resolution against a world size into a `RunPlan` (`resolve`, pure: an explicit step)."""
