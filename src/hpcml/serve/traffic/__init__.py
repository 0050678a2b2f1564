"""Where requests go: the router (versions, canary, shadow, rollback) and its policies, alias
following, admission limits and drift monitoring."""
