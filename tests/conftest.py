from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

# Shared, noisy CI machines: never fail a property on wall-clock time.
settings.register_profile(
    "dp", deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dp"))
