"""The autoscaling planner: profiles, load predictors, SLA sizing and the fleet simulator. Pure Python."""
