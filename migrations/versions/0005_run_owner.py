"""run owner: the token that registered a run

Only that token (or an admin token) may change the run afterwards: fill in its fields, raise its
world size, reopen it, merge its meta, finish it. Runs registered before this migration have no
owner and keep the old rules.

Revision ID: 0005
Revises: 0004
"""
from alembic import op
import sqlalchemy as sa

revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('runs', sa.Column('owner_token_id', sa.Integer(), nullable=True))


def downgrade() -> None:
    op.drop_column('runs', 'owner_token_id')
