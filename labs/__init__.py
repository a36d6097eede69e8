"""Optional notebooks and their helpers: measurement method, tuning histories, profiles."""
