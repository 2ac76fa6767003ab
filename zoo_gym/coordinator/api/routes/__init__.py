"""One router per area of the REST API."""
