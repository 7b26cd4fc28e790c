"""Draft service: DFlash drafter + DDTree builder proposing draft token trees."""
