"""The routing decisions both router paths share."""
