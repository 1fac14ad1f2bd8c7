"""retention: runs.thinned records what the retention policy removed from a run

``{"blocks": iso time}`` once the per-rank blocks of its steps were dropped (the per-step rollups
stay), ``{"rollups": iso time}`` once the per-step rows were dropped too (the run, its cached
figures, straggler rollups and collective totals stay). NULL: nothing removed.

Revision ID: 0008
Revises: 0007
"""
from alembic import op
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

revision = '0008'
down_revision = '0007'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('runs', sa.Column('thinned', postgresql.JSONB(astext_type=sa.Text()), nullable=True))


def downgrade() -> None:
    op.drop_column('runs', 'thinned')
