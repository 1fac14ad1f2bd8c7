"""projections and their track record (issue: Plan before spending GPUs)

Reserved revision: filled in by the change that needs it (a no-op until then).

Revision ID: 0023
Revises: 0022
"""
from alembic import op  # noqa: F401
import sqlalchemy as sa  # noqa: F401

revision = '0023'
down_revision = '0022'
branch_labels = None
depends_on = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
