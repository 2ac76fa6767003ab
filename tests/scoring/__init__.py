"""Tests of `zoo_gym.scoring`: quality methods, reward split and reputation."""
