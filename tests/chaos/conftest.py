from tests.e2e.conftest import demo_model  # noqa: F401  (shared session fixture)
