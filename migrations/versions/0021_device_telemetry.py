"""device telemetry per rank and window (issue: Why this GPU)

Reserved revision: filled in by the change that needs it (a no-op until then).

Revision ID: 0021
Revises: 0020
"""
from alembic import op  # noqa: F401
import sqlalchemy as sa  # noqa: F401

revision = '0021'
down_revision = '0020'
branch_labels = None
depends_on = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
