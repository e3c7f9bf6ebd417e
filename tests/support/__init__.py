"""What the tests share: the rank launcher, models, fixtures, scripts run as ranks."""
